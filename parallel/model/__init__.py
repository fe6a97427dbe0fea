"""A serial model turned into its split form: parallelize, ParallelModule, gradient sync."""
