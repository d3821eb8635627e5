package transport

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
)

// templateFields are the fields a Template may reference, written {name}.
var templateFields = map[string]func(m *outbox.Message) string{
	"event_id":       func(m *outbox.Message) string { return m.EventID },
	"event_type":     func(m *outbox.Message) string { return m.EventType },
	"aggregate_type": func(m *outbox.Message) string { return m.AggregateType },
	"aggregate_id":   func(m *outbox.Message) string { return m.GroupID },
	"sequence":       func(m *outbox.Message) string { return strconv.FormatInt(m.Sequence, 10) },
	"tenant_id":      func(m *outbox.Message) string { return m.Attributes[envelope.AttrTenantID] },
	"traceparent":    func(m *outbox.Message) string { return m.Attributes[envelope.AttrTraceparent] },
}

// TemplateFields lists the fields a Template may reference.
const TemplateFields = "{event_id} {event_type} {aggregate_type} {aggregate_id} {sequence} {tenant_id} {traceparent}"

// Template is a broker topology's routing key, subject or header template
// (RabbitMQ, NATS): literal text and {field} references to the outgoing
// message, rendered without allocation beyond the result. (Wire profiles,
// pkg/wire, have a richer language over the whole envelope.)
type Template struct {
	parts []templatePart
}

type templatePart struct {
	lit   string
	field func(m *outbox.Message) string
}

// ParseTemplate parses s, e.g. "{aggregate_type}.{event_type}".
func ParseTemplate(s string) (Template, error) {
	var t Template
	for len(s) > 0 {
		i := strings.IndexByte(s, '{')
		if i < 0 {
			if strings.IndexByte(s, '}') >= 0 {
				return Template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, templatePart{lit: s})
			break
		}
		if i > 0 {
			if strings.IndexByte(s[:i], '}') >= 0 {
				return Template{}, fmt.Errorf("unmatched '}' in %q", s)
			}
			t.parts = append(t.parts, templatePart{lit: s[:i]})
		}
		j := strings.IndexByte(s[i:], '}')
		if j < 0 {
			return Template{}, fmt.Errorf("unclosed '{' in %q", s)
		}
		name := s[i+1 : i+j]
		f, ok := templateFields[name]
		if !ok {
			return Template{}, fmt.Errorf("unknown field {%s}: use one of %s", name, TemplateFields)
		}
		t.parts = append(t.parts, templatePart{field: f})
		s = s[i+j+1:]
	}
	return t, nil
}

// Render fills the template from m, passing each field's value through
// clean (nil: as it is; literal text is kept as written). A template made
// of one field whose value is empty renders empty, so optional headers can
// be left out (Single).
func (t Template) Render(m *outbox.Message, clean func(string) string) string {
	if clean == nil && len(t.parts) == 1 {
		if p := t.parts[0]; p.field != nil {
			return p.field(m)
		}
		return t.parts[0].lit
	}
	var b strings.Builder
	for _, p := range t.parts {
		if p.field == nil {
			b.WriteString(p.lit)
			continue
		}
		v := p.field(m)
		if clean != nil {
			v = clean(v)
		}
		b.WriteString(v)
	}
	return b.String()
}

// Single reports whether the template is one field alone (a header whose
// value may be empty, and is then left out).
func (t Template) Single() bool { return len(t.parts) == 1 && t.parts[0].field != nil }
