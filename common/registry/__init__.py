"""Every link's backends by name, the lowest floor of common/ (it imports nothing else of it): the generic `Registry`
(base.py) and, per link the config names a backend of, its table of specs (engines.py, tasks.py, transports.py,
environments.py, rewards.py). A spec names its backend's module as a path; the link's own package imports it when a process
builds the backend, so the config checks names and settings against the tables without importing any backend."""
