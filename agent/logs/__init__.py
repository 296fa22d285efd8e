"""``liubai logs``: reports over the session database."""
