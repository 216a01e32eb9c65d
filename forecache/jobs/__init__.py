"""Batch jobs: requests as JSON lines (``requests``), a job's plan on this machine, measured on
the loaded model (``plan``), and a whole job as ``forecache batch`` runs it (``run.run_job``);
``forecache.batch`` writes the output and decodes the requests."""
