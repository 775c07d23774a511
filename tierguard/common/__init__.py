"""Small pieces shared by every concern: user-facing errors and unit parsing."""
