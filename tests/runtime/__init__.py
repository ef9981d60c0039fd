"""Runtime all-to-all tier: multi-process gloo tests against ``all_to_all_single`` references."""
