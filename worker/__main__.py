from worker.entry import main

main()
