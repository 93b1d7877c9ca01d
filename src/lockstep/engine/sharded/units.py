"""Which submodules of a model get a `fully_shard` of their own (an FSDP unit each); the rest go to the root's.

A unit is what FSDP2 all-gathers before its forward and reduce-scatters after its backward: the finer the
units, the lower the peak memory (one unit's full parameters at a time) and the more collectives. The
default follows torchtitan: each repeated block (the children of a ModuleList or Sequential that holds two
or more modules of one class with parameters: a transformer's blocks) is a unit; a model without repeated
blocks gets FSDP1's size rule (a module whose parameters not yet in a unit reach `min_params`, children
first). A unit never splits tied parameters: a module whose parameters are also used outside it (TinyGPT's
head is its token embedding) is no unit, and its parameters stay with an enclosing one (the root's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from lockstep.errors import ConfigError

MIN_PARAMS = 100_000  # the size rule's threshold, in elements (FSDP1's size_based_auto_wrap_policy's idea)

UnitRule = Callable[[nn.Module], bool]


def choose_units(
    module: nn.Module,
    rule: UnitRule | Iterable[type[nn.Module]] | None = None,
    *,
    min_params: int = MIN_PARAMS,
) -> list[nn.Module]:
    """The submodules to shard as units, children before parents (FSDP2 wants them wrapped bottom-up).

    `rule`: None for the default (see the module doc), a set of module classes (each instance is a unit,
    as torch users pass transformer block classes), or a predicate on modules. A module the rule picks
    whose parameters are tied to one outside it is refused by name (it cannot be a unit of its own)."""
    owners = _owners(module)
    if rule is None:
        picked = _repeated_blocks(module, owners) or _by_size(module, owners, min_params)
    else:
        predicate = _predicate(rule)
        picked = [m for name, m in module.named_modules() if m is not module and predicate(m)]
        for m in picked:
            outside = _tied_outside(m, owners)
            if outside:
                name = _name_of(module, m)
                raise ConfigError(
                    f"module {name!r} cannot be an FSDP unit of its own: its parameter {outside!r} is tied to "
                    "a module outside it (FSDP2 would shard one parameter twice); leave it to an enclosing unit"
                )
    nested = {id(m) for m in picked}
    return [m for m in _post_order(module) if id(m) in nested]


def _predicate(rule: UnitRule | Iterable[type[nn.Module]]) -> UnitRule:
    if callable(rule) and not isinstance(rule, type):
        return rule
    classes = tuple(rule)  # type: ignore[arg-type]
    return lambda m: isinstance(m, classes)


def _owners(root: nn.Module) -> dict[int, list[nn.Module]]:
    """Each parameter (by id) with every module that holds it directly (a tied one has several)."""
    owners: dict[int, list[nn.Module]] = {}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    return owners


def _tied_outside(unit: nn.Module, owners: dict[int, list[nn.Module]]) -> str | None:
    """The name of a parameter of `unit` that a module outside it holds too, or None."""
    inside = {id(m) for m in unit.modules()}
    for name, p in unit.named_parameters(remove_duplicate=False):
        if any(id(m) not in inside for m in owners[id(p)]):
            return name
    return None


def _repeated_blocks(root: nn.Module, owners: dict[int, list[nn.Module]]) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for m in root.modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = [c for c in m.children() if any(True for _ in c.parameters())]
        kinds = {type(c) for c in children}
        if len(children) >= 2 and len(kinds) == 1 and not any(_tied_outside(c, owners) for c in children):
            if not any(b in blocks for b in _ancestors_in(root, m, blocks)):
                blocks += children
    return blocks


def _ancestors_in(root: nn.Module, target: nn.Module, chosen: list[nn.Module]) -> list[nn.Module]:
    """The chosen modules that contain `target` (a block inside a block stays in the outer one)."""
    return [c for c in chosen if any(sub is target for sub in c.modules())]


def _by_size(root: nn.Module, owners: dict[int, list[nn.Module]], min_params: int) -> list[nn.Module]:
    units: list[nn.Module] = []
    taken: set[int] = set()
    for m in _post_order(root):
        if m is root:
            continue
        rest = [p for p in m.parameters() if id(p) not in taken]
        if sum(p.numel() for p in rest) >= min_params and not _tied_outside(m, owners):
            units.append(m)
            taken.update(id(p) for p in rest)
    return units


def _post_order(root: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        order.append(m)

    visit(root)
    return order


def _name_of(root: nn.Module, target: nn.Module) -> str:
    return next((name for name, m in root.named_modules() if m is target), type(target).__name__)


def check_shardable(root: nn.Module) -> None:
    """Refuse, by name, what FSDP2 cannot shard (it would fail deep inside fully_shard or the first
    backward): a scalar parameter (FSDP2 cuts dim 0) and an embedding with sparse gradients (its
    reduce-scatter copies dense chunks)."""
    for name, m in root.named_modules():
        where = f"module {name!r} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
        for pname, p in m.named_parameters(recurse=False):
            if p.dim() == 0:
                raise ConfigError(
                    f"{where} has a scalar parameter {pname!r}: FSDP2 shards a parameter's first dimension; "
                    "make it a 1-D tensor of one element (torch.tensor([x])), or keep shard_degree at 1"
                )
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise ConfigError(
                f"{where} makes sparse gradients (sparse=True), which FSDP2 cannot reduce-scatter; use "
                "sparse=False, or keep shard_degree at 1"
            )
