"""The `flywheel loop run` process: one data_dir's flywheel, serving its production version,
taking traces and running cycles when loop/trigger.py says one is due (loop_daemon.py)."""
