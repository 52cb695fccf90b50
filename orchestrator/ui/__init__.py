"""What a person looks at: the dashboard (served live or over a finished run), its Prometheus metrics
and the static report."""
