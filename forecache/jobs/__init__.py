"""Batch jobs: requests as JSON lines (``requests``) and a job's plan on this machine, measured on
the loaded model (``plan``). ``forecache.batch`` runs them."""
