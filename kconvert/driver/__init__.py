"""The driver: a conversion command from its options (commands) and its recipe (recipes),
what the run will do (run_plan), the run itself (convert), the files written after its shards
(finish_output, manifest_writer), and what it prints (dry_run, run_summary)."""
