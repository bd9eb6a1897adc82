"""privlm bench attacks: the strongest attacks on all three systems."""
