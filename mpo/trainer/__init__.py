"""The RL loop: rollouts -> rewards -> advantages -> old log-probs (+ routing) -> updates -> weight sync -> metrics."""
