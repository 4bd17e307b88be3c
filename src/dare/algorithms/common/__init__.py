"""What several methods share, in one place: views and their layouts, ELBO estimators, block helpers, the
trajectory replay, and batched scoring / per-view backward. A method file holds only what is its own."""
