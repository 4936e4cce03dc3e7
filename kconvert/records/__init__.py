"""What a finished run records: the audit manifest's models, schema and reading
(manifest); the driver writes it (kconvert.driver.manifest_writer), the audit reads it."""
