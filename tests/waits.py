"""How long a test waits for a request's result: a guard against a hang, never a bound on speed. A loaded CI
machine (two cores, other jobs) ran a 10-token batch of the tiny model for over 100 s, so a wait of 60 s
failed tests whose results were right; a hang still fails, after this long."""

RESULT_WAIT_S = 900
