"""Result records and what turns them into tables, JSON and plots."""
