"""Layer L0: errors, dtypes and environment flags shared by every other layer."""
