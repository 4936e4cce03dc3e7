"""What a Kimi-K2 / DeepSeek-V3 checkpoint is: how its tensor names are spelled."""



