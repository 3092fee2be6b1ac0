from llmtune.cli import main

main()
