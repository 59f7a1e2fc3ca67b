"""Reports on finished jobs: per-route statistics, charts, shadow comparisons, chat export."""
