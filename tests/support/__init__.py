"""What tests in several folders share: the chat gateway's stub upstream and helpers (chat.py)."""
