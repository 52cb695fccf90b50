"""orchestrator: cluster YAML to spot instances (a local simulator by default; AWS and GCP), one Ray
actor per instance, a supervisor that replaces preempted instances, resumable runs, dashboards.

Ray is imported here and nowhere below, so the library layers run without it.
"""
