"""The `flywheel worker` process: claims fine-tuning jobs and flywheel cycles from the job store
(job_worker.py) and trains each in a child forked from a pre-imported zygote (zygote.py,
job_run.py), so one job's crash or leak never reaches another or the server."""
