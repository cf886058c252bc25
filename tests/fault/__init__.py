"""The fault suite: a workload under faults (``chaos``), checked against what
every client was told (``checker``)."""
