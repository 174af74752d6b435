"""Mixed precision under a byte budget: each layer's sensitivity to each scheme of a menu, and the knapsack."""
