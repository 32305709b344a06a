"""The RL learner's runtime, below the recipes (train/sft.py, rl.py, dpo.py use it; it uses
the update math: rl_step.py, checkpoint.py, lora.py, ...).

    protocol.py        Learner: the calls run_rl makes, wherever the learner runs
    rl_learner.py      RLLearner: the policy, its optimizer and schedule (or one rank of it)
    start.py           start_learner: which learner a config asks for
    group.py           LearnerGroup: several ranks driven as one; ProcessLearner: local ranks
    ray_actors.py      RayLearner: the ranks as Ray actors
    ranks.py           Rank: this process's place in an FSDP2 learner, its collectives
    rank_processes.py  launch / RankProcesses: starting ranks as local processes
    fsdp2_rl.py        rl_step_fsdp2: the RL update across ranks
"""
