"""What a run leaves behind: ``rundir`` (config.json, result.json, the lock), ``metrics``
(metrics.jsonl and the run summary), ``report`` (the console summary, progress bar and
plots).
"""
