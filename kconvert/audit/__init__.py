"""`kconvert audit`: prove a checkpoint is what it claims to be (kconvert.audit.auditor)."""
