package sns

import (
	"encoding/json"
	"fmt"
	"sort"
)

// QueueURLs locates one consumer's queue and DLQs.
type QueueURLs struct {
	QueueURL string `json:"queue_url"`
	DLQURL   string `json:"dlq_url"`
	// SubscriptionDLQURL is the DLQ of the consumer's SNS subscription
	// (topology.Consumer.SubscriptionDLQName); optional, needed to redrive
	// from the subscription DLQ.
	SubscriptionDLQURL string `json:"subscription_dlq_url,omitempty"`
}

// Queues maps consumer name to its queues (FIFOBOX_QUEUES).
type Queues map[string]QueueURLs

// ParseQueues parses the FIFOBOX_QUEUES JSON, an object consumer name ->
// {"queue_url", "dlq_url", "subscription_dlq_url" (optional)}. Empty means
// no queues.
func ParseQueues(s string) (Queues, error) {
	q := Queues{}
	if s == "" {
		return q, nil
	}
	if err := json.Unmarshal([]byte(s), &q); err != nil {
		return nil, fmt.Errorf("%s: want a JSON object consumer -> {\"queue_url\",\"dlq_url\"}: %w", EnvQueues, err)
	}
	for name, u := range q {
		if u.QueueURL == "" || u.DLQURL == "" {
			return nil, fmt.Errorf("%s: consumer %q needs queue_url and dlq_url", EnvQueues, name)
		}
	}
	return q, nil
}

// Names returns the consumer names in order.
func (q Queues) Names() []string {
	n := make([]string, 0, len(q))
	for k := range q {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}
