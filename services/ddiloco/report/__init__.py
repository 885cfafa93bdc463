"""``ddiloco report RUN_DIR``: plots and a markdown summary of any run folder."""
