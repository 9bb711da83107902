"""Running a job: the controller's step loop, the inline and Ray executors, the worker and training
helpers, weight sync, torch.distributed setup, reward dispatch, prompt data, the thread policy, signals,
trackers and evaluation."""
