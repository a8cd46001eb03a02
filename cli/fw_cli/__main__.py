from fw_cli.main import main

main()
