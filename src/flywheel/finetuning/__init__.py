"""The fine-tuning service's core, shared by the server's routes (serve/) and `flywheel worker`
(worker/), knowing nothing of HTTP: uploads and job creation with their checks
(fine_tuning.py, job_validation.py), managed flywheels (managed_flywheels.py: creation;
managed_config.py: a flywheel's request as the LoopConfig its cycles run; flywheel_trigger.py:
the server thread that queues their cycles)."""
