"""Evaluation (applications): the run loop (`runner`), tables/plots/JSON-lines logs (`report`, plots need
matplotlib), the selection pictures (`selection`, `viz`), run comparison and merging (`compare`, `merge`)
and the auto-budget calibration (`calibrate`). The tasks, their scoring and the agreement test are `kvstitch.tasks`.
"""
