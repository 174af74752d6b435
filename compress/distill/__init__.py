"""Training after compression: knowledge distillation (Minitron repair), its sharded state (FSDP2), scale tuning."""
