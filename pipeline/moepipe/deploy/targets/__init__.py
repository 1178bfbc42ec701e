"""deploy/targets"""
