package amqp

import (
	"fmt"
	"strings"

	"github.com/fifobox/fifobox/pkg/outbox"
)

// Selects reports whether the consumer's bindings select m, as the exchange
// would route it: replay sends a consumer only the events its queue would
// have received.
func (o *Operations) Selects(consumer string, m outbox.Message) (bool, error) {
	c, err := o.consumer(consumer)
	if err != nil {
		return false, err
	}
	return o.cfg.Topology.selects(c, &m), nil
}

func (t *Topology) selects(c Consumer, m *outbox.Message) bool {
	switch t.Exchange.Kind {
	case KindFanout:
		return true
	case KindHeaders:
		h := t.headersFor(m)
		for _, b := range c.Bindings {
			all := true
			for k, v := range b.Headers {
				if fmt.Sprint(h[k]) != v {
					all = false
					break
				}
			}
			if all {
				return true
			}
		}
		return false
	}
	key := t.routingKey.Render(m, nil)
	for _, b := range c.Bindings {
		if t.Exchange.Kind == KindDirect && b.Key == key {
			return true
		}
		if t.Exchange.Kind == KindTopic && topicMatch(strings.Split(b.Key, "."), strings.Split(key, ".")) {
			return true
		}
	}
	return false
}

// topicMatch is AMQP topic matching: "*" is exactly one word, "#" zero or
// more words.
func topicMatch(pattern, words []string) bool {
	if len(pattern) == 0 {
		return len(words) == 0
	}
	switch pattern[0] {
	case "#":
		for i := 0; i <= len(words); i++ {
			if topicMatch(pattern[1:], words[i:]) {
				return true
			}
		}
		return false
	case "*":
		return len(words) > 0 && topicMatch(pattern[1:], words[1:])
	}
	return len(words) > 0 && pattern[0] == words[0] && topicMatch(pattern[1:], words[1:])
}
