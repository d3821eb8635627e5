package lambdafn

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"

	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// EnvAMQPUserSecrets is set on the provisioning (migration) function only:
// the functions' own broker users, which migrate creates on the broker with
// their roles' permissions, as JSON {"dispatcher": "<secret ARN>",
// "operations": "<ARN>", "consumer:<name>": "<ARN>", ...}; each secret holds
// {"username","password"}.
const EnvAMQPUserSecrets = "FIFOBOX_AMQP_USER_SECRETS"

// userCredentials reads the secrets FIFOBOX_AMQP_USER_SECRETS names into
// b.AMQP.Users, for the provisioner. Errors name the variable and the role,
// never a secret's value.
func (b *Broker) userCredentials(ctx context.Context, fetch SecretFunc) error {
	raw := BrokerEnv.Get(EnvAMQPUserSecrets)
	if raw == "" {
		return nil
	}
	if b.Kind != transport.RabbitMQ {
		return fmt.Errorf("%s is set, but %s=%s: broker users are RabbitMQ's", EnvAMQPUserSecrets, transport.EnvTransport, b.Kind)
	}
	var arns map[string]string
	if err := json.Unmarshal([]byte(raw), &arns); err != nil {
		return fmt.Errorf("%s: want a JSON object of role to secret ARN: %w", EnvAMQPUserSecrets, err)
	}
	keys := make([]string, 0, len(arns))
	for k := range arns {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	users := make([]amqp.User, 0, len(keys))
	for _, key := range keys {
		role, consumer, err := amqp.ParseUserKey(key)
		if err != nil {
			return fmt.Errorf("%s: %w", EnvAMQPUserSecrets, err)
		}
		if role == amqp.RoleConsumer {
			if _, ok := b.AMQP.Topology.Consumer(consumer); !ok {
				return fmt.Errorf("%s: %s: consumer %q is not in the topology", EnvAMQPUserSecrets, key, consumer)
			}
		}
		v, err := fetch(ctx, arns[key])
		if err != nil {
			return fmt.Errorf("%s: %s: read secret: %w", EnvAMQPUserSecrets, key, err)
		}
		var s brokerSecret
		if err := json.Unmarshal([]byte(v), &s); err != nil || s.Username == "" || s.Password == "" {
			return fmt.Errorf("%s: %s: the secret needs username and password", EnvAMQPUserSecrets, key)
		}
		users = append(users, amqp.User{Name: s.Username, Password: s.Password, Role: role, Consumer: consumer})
	}
	b.AMQP.Users = users
	return nil
}
