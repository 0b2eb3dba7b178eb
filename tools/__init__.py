"""Developer tools that are not part of the pipeline (generators of committed files)."""
