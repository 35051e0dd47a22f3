"""Lightning: the callback and its parts (alerts, logs, postmortem, ranks), wired to Lightning's hooks."""
