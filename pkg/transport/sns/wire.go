package sns

import (
	"fmt"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// render returns msgs as PublisherConfig.Wire renders them: the profile's
// body, its message attributes (all of type String), its group id, and its
// deduplication id in EventID (what the publisher sends as
// MessageDeduplicationId). A message that does not render gets a permanent
// error in errs and is not sent.
func (p *Publisher) render(msgs []outbox.Message, errs []error) []outbox.Message {
	out := make([]outbox.Message, len(msgs))
	for i := range msgs {
		out[i] = msgs[i]
		w, err := p.cfg.Wire.Render(&msgs[i])
		if err != nil {
			errs[i] = envelope.Permanent(err)
			continue
		}
		attrs := make(map[string]string, len(w.Headers))
		for _, h := range w.Headers {
			attrs[h.Name] = fmt.Sprint(h.Value)
		}
		out[i].Body, out[i].Attributes, out[i].GroupID, out[i].EventID = w.Body, attrs, w.GroupID, w.DedupID
	}
	return out
}
