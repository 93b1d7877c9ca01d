"""What a run tells as it goes: its metrics (reduced across ranks), the console progress on rank 0, and
the metric log.

Modules:
- metrics.py: fit's metrics: summed on the device between log steps, reduced across ranks in one packed all-
  reduce.
- progress.py: The console progress display on global rank 0 only: a tqdm bar in a terminal, plain lines
  otherwise.
- run_log.py: The run's metric log on rank 0: JSONL and CSV always, TensorBoard when installed, a PNG plot at
  the end.
- run_records.py: What fit keeps of a run besides its metrics: its time account (goodput, runtime/run_account.py)
  and its timeline (runtime/timeline/), opened with the run, carried through a resume, closed at its end.
- timeline_plot.py: run_dir/timeline.png: the run's timeline at a glance, drawn from the parts of
  runtime/timeline/.
"""
