from owai.cli import main

main()
