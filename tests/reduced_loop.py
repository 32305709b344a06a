"""A managed flywheel's loop reduced to machinery (tests/service/test_flywheels.py, tests/browser):
small stages and a gate that admits any candidate, so the outcome does not depend on learning."""

MACHINERY = {
    "training": {"order": ["sft"], "lora": {"rank": 4, "alpha": 8}, "sft": {"steps": 2, "batch_size": 4},
                 "min_examples": 1},
    "eval": {"suites": {"add": {"env": "arithmetic", "tasks": 4, "max_tokens": 8}}, "new_failures_max_tokens": 8},
    "gate": {"delta": 0.0, "epsilon": 1.0, "min_new_failures": 1},
    "trigger": {"min_new_failures": 10},
    # half the prompts held out: of the >= 10 failures a cycle starts on, one at least is a new
    # held-out failure to gate on (at 0.25 none was, now and then)
    "curation": {"heldout_fraction": 0.5},
}
