"""privlm bench detect: how much of the personal details the detector catches, and how fast, beside Presidio."""
