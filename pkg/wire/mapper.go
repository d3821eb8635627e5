package wire

import (
	"fmt"
	"time"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// Mapper renders outbox messages as one transport's profile section says.
// It is safe for concurrent use.
type Mapper struct {
	p         *Profile
	transport string
	needBody  bool
	headers   []header
	dest      template // routing key or subject
	msgID     template
	typ       template
	group     template
	dedup     template
	timestamp string
}

// Message is one event as a transport sends it.
type Message struct {
	// Body is the message body.
	Body []byte
	// ContentType of the body.
	ContentType string
	// MessageID (AMQP message_id, NATS Nats-Msg-Id).
	MessageID string
	// Timestamp (AMQP timestamp); zero for none.
	Timestamp time.Time
	// Type (AMQP type property).
	Type string
	// Destination is the routing key (RabbitMQ) or the subject (NATS).
	Destination string
	// GroupID and DedupID are SNS FIFO's MessageGroupId and MessageDeduplicationId.
	GroupID, DedupID string
	// Headers (SNS: message attributes), in name order.
	Headers []Header
}

// Mapper compiles the profile for one transport ("rabbitmq", "nats" or
// "sns"); the profile must have that section.
func (p *Profile) Mapper(transport string) (*Mapper, error) {
	m := &Mapper{p: p, transport: transport}
	refs := p.body.refs()
	switch transport {
	case TransportRabbitMQ:
		r := p.RabbitMQ
		if r == nil {
			return nil, fmt.Errorf("profile %s: no rabbitmq section", p.Name)
		}
		m.headers, m.dest, m.msgID, m.typ, m.timestamp = r.headers, r.key, r.msgID, r.typ, r.Timestamp
		refs = append(refs, r.msgID.refs()...)
		refs = append(refs, r.typ.refs()...)
		if m.timestamp == "occurred_at" {
			m.needBody = true
		}
	case TransportNATS:
		n := p.NATS
		if n == nil {
			return nil, fmt.Errorf("profile %s: no nats section", p.Name)
		}
		m.headers, m.dest, m.msgID = n.headers, n.subject, n.msgID
		refs = append(refs, n.msgID.refs()...)
	case TransportSNS:
		s := p.SNS
		if s == nil {
			return nil, fmt.Errorf("profile %s: no sns section", p.Name)
		}
		m.headers, m.group, m.dedup = s.headers, s.group, s.dedup
		refs = append(refs, s.group.refs()...)
		refs = append(refs, s.dedup.refs()...)
	default:
		return nil, fmt.Errorf("profile %s: transport %q: rabbitmq, nats or sns", p.Name, transport)
	}
	refs = append(refs, m.dest.refs()...)
	refs = append(refs, headerRefs(m.headers)...)
	for _, r := range refs {
		if r.needsBody() {
			m.needBody = true
		}
	}
	return m, nil
}

// Profile returns the profile the mapper was compiled from.
func (m *Mapper) Profile() *Profile { return m.p }

// Render turns a claimed outbox message into what goes on the wire. Its
// errors are permanent for that event (a stored body that is not fifobox's
// envelope, a group id SNS would refuse): no retry renders it differently.
func (m *Mapper) Render(msg *outbox.Message) (Message, error) {
	e := event{m: msg, idFmt: m.p.EventIDFormat}
	if m.needBody {
		if err := e.decode(); err != nil {
			return Message{}, err
		}
	}
	out := Message{ContentType: m.p.ContentType}
	var err error
	if out.Body, err = m.p.body.render(make([]byte, 0, len(msg.Body)+64), &e); err != nil {
		return Message{}, fmt.Errorf("wire: body: %w", err)
	}
	if out.Headers, err = renderHeaders(m.headers, &e); err != nil {
		return Message{}, fmt.Errorf("wire: headers: %w", err)
	}
	if out.Destination, err = m.dest.render(&e); err != nil {
		return Message{}, err
	}
	if out.MessageID, err = m.msgID.render(&e); err != nil {
		return Message{}, err
	}
	if out.Type, err = m.typ.render(&e); err != nil {
		return Message{}, err
	}
	switch m.timestamp {
	case "occurred_at":
		out.Timestamp = e.occurred()
	case "published":
		out.Timestamp = time.Now()
	}
	if m.transport == TransportSNS {
		if out.GroupID, err = m.group.render(&e); err != nil {
			return Message{}, err
		}
		if out.DedupID, err = m.dedup.render(&e); err != nil {
			return Message{}, err
		}
		if err := envelope.CheckGroupID("group_id", out.GroupID); err != nil {
			return Message{}, fmt.Errorf("wire: sns.group_id: %w", err)
		}
		if err := envelope.CheckGroupID("dedup_id", out.DedupID); err != nil {
			return Message{}, fmt.Errorf("wire: sns.dedup_id: %w", err)
		}
	}
	if m.transport == TransportNATS && !ValidNATSSubject(out.Destination, false) {
		return Message{}, fmt.Errorf("wire: nats.subject: %q is not a valid subject", out.Destination)
	}
	return out, nil
}
