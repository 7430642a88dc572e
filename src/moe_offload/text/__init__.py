"""Real text available offline: the training corpus of the bundled model and the prompts the recorder replays."""
