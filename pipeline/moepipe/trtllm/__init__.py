"""trtllm"""
