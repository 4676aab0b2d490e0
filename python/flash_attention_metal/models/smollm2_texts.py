"""The default prompt of examples/smollm2_generate.py: a document and a question about it.

The document is long enough (590 tokens with the chat template) that every decode step attends
over more than 512 cached keys, where the library takes its split-KV path (at least two chunks
of FA_SPLIT_MIN_CHUNK_KEYS = 256 keys). The text was written for this repository; the village is
fictional.
"""

DOCUMENT = "\n\n".join([
    (
        'The village of Harrowby sits on a narrow spit of land where the river Dene meets the '
        'North Sea. For most of its history it was a fishing village of perhaps two hundred '
        'people, and its life was ruled by the tides. Boats left before dawn and came back in the '
        'afternoon, and the whole village walked down to the harbour to see what the sea had '
        'given. The sandbanks at the mouth of the river shift with every winter storm, and the '
        'old charts of the coast mark them with the warning that no pilot should trust last '
        "year's map."
    ),
    (
        'In 1871 a schooner carrying coal from Newcastle ran aground on the outer bank in a '
        'January gale. Nine of her crew of eleven were drowned within sight of the harbour wall, '
        'and the village could do nothing but watch. The loss led the harbour board to petition '
        'for a light, and after six years of letters and two changes of engineer, the Harrowby '
        'lighthouse was finished in the spring of 1877. It is a white tower of local sandstone, '
        'twenty-six metres tall, with a lantern that first burned paraffin and was converted to '
        'electricity in 1952.'
    ),
    (
        "The first keeper was a former ship's carpenter named Thomas Ellery, who kept the light "
        'for thirty-one years with his wife Margaret. Their log books survive in the village '
        'museum. They record the weather every four hours, the ships that passed, and the small '
        'events of a life spent on a rock: a seal that slept on the landing for a week, a winter '
        'when the river froze from bank to bank, the night in 1894 when Margaret rowed out alone '
        'to bring two boys back from the bank after their dinghy overturned. She was awarded a '
        'silver medal for that rescue, and it hangs in the museum next to the logs.'
    ),
    (
        'The light was automated in 1989, and the last keeper, a quiet man named David Rowe, '
        'moved into the village, where he ran the post office until he retired. Today the tower '
        'is owned by a charitable trust. Volunteers open it to visitors on summer weekends, and '
        'from the gallery at the top you can see the whole curve of the bay, the wind farm on the '
        'horizon, and on a clear day the hills thirty kilometres inland. The fishing fleet is '
        'down to three boats, but the village has found a second life through walkers, '
        'birdwatchers and families who come for the long sandy beach. Every January the village '
        'holds a short service at the harbour wall to remember the crew of the schooner whose '
        'loss brought the light.'
    ),
])

QUESTION = "Who was the first keeper of the lighthouse, and what did his wife do in 1894?"

PROMPT = f"{DOCUMENT}\n\n{QUESTION}"
