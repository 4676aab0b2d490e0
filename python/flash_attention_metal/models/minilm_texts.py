"""Sample texts for the MiniLM example and fixture: from a few tokens up to the model's 256-token
limit, so the attention runs over short, odd, block-straddling and long sequence lengths.
Written for this project."""

SAMPLE_TEXTS = (
    "Attention is all you need.",
    "The river froze early this year, and the ferry stopped running in November.",
    "A lighthouse keeper counts the ships that pass each night, writes their names in a ledger, "
    "and trims the wick before dawn so the lamp burns clean for the fishing boats coming home.",
    "Sourdough bread needs patience more than skill. The starter is fed flour and water for days "
    "until it bubbles reliably; the dough is mixed, folded every half hour, left to rise overnight "
    "in a cool kitchen, shaped gently so the gas stays inside, and baked in a very hot covered pot. "
    "The crust cracks as it cools, which bakers call singing.",
    "The committee met on Tuesday to review the proposal for a new cycling path along the old "
    "railway line. Supporters argued that the route is flat, already cleared, and connects three "
    "villages to the station, so commuters could leave their cars at home. Farmers whose fields "
    "border the line asked for fences and for gates at the crossings used by their tractors. A "
    "local historian wanted the signal box and the platform edges preserved, with small boards "
    "explaining how the branch carried milk and timber until it closed in the nineteen sixties. "
    "The treasurer pointed out that a regional grant would cover most of the surface work but not "
    "the bridges, two of which need new decks before anyone can walk on them safely. After a long "
    "discussion the committee agreed to commission a survey of the bridges, to meet the farmers "
    "on site, and to publish a revised plan for comment before the summer.",
    "Matrix multiplication sits at the heart of modern machine learning, and the way a program "
    "moves data through memory often matters more than the number of arithmetic operations it "
    "performs. A graphics processor can multiply small tiles of numbers extremely quickly, but "
    "only if those tiles are already waiting in its fast on-chip memory. Fetching them from the "
    "large, slow main memory again and again wastes most of the available time. Attention layers "
    "are a striking example: the naive method writes a full square table of scores, one for every "
    "pair of positions, to main memory, reads it back to compute a softmax, writes the result, and "
    "reads it once more to weight the values. Tiled algorithms instead stream blocks of keys and "
    "values past a block of queries, keep a running maximum and a running sum for each row, and "
    "rescale the partial output whenever the maximum grows. The square table never exists in full, "
    "memory traffic grows linearly with the sequence length, and the result is the same up to "
    "rounding. The backward pass recomputes the scores block by block from the saved row "
    "statistics rather than storing them, trading a little extra arithmetic for a large saving in "
    "memory, which is usually the scarcer resource on both laptops and data-centre accelerators.",
)
