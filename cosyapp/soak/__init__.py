"""``python -m cosyapp.soak``: the app under mixed good and bad clients for a while, every answer
checked; and how leaks are told from allocator steps (memory.py), also used by the overload tests."""
