"""The timing models' view of a model and a batch job: shapes at a quantization, and a batch
job's throughput under a plan (MoE-Lightning's hierarchical roofline)."""
