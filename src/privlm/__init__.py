"""privlm."""
